"""`experiment/` and `sweep/` options compose at the root of the config in every config folder —
conf/, a `--config-dir`, `hydra.searchpath`, the site folder ($MARIN_SITE) — with or without a
`# @package _global_` header, so a user's own experiment or sweep works as the shipped ones do.

An experiment or a sweep sets leaves all over the config (`train.steps`, `hydra.sweeper.params`),
so it belongs at the root. Hydra takes an option's package only from its header or from the
defaults-list entry, and an entry `experiment@_global_` would make every `experiment=x` on the
command line an error (it would have to say `experiment@_global_=x`). So the file source supplies
the header for these two groups when the file has none. This subclass of Hydra's FileConfigSource
serves `file://` folders: Hydra imports every plugin module before it registers any plugin, and
its source registry keeps the first class registered for a scheme, so registering it when this
module is imported puts it in the place of Hydra's own. (hydra-core is pinned in constraints.txt;
tests/config/test_site.py composes a header-less experiment and sweep from a `--config-dir`
folder and from the site folder, so a Hydra that worked otherwise would fail there.)
"""
from __future__ import annotations

from hydra._internal.core_plugins import file_config_source as hydra_file
from hydra._internal.sources_registry import SourcesRegistry
from hydra.plugins.config_source import ConfigResult

GLOBAL_GROUPS = ("experiment", "sweep")  # conf/config.yaml: `experiment: null`, `sweep: null`


class FileConfigSource(hydra_file.FileConfigSource):
    def load_config(self, config_path: str) -> ConfigResult:
        result = super().load_config(config_path)
        group, _, option = config_path.partition("/")
        if option and group in GLOBAL_GROUPS and not result.header.get("package"):
            result.header["package"] = "_global_"
        return result


SourcesRegistry.instance().register(FileConfigSource)  # before Hydra's (same name: Hydra's is then skipped)
