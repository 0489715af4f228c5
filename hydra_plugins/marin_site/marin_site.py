"""$MARIN_SITE on Hydra's config search path: a folder shaped like conf/ whose `local/site.yaml`
(`# @package _global_`) holds the site's settings — data.root, tracking.uri, the Slurm partition
and account — so they need not be typed on every command. conf/config.yaml selects it with
`optional local: site`, after the groups, so it overrides them; the command line overrides it.
conf/local/site.yaml in the project (git-ignored) is found first; neither is needed.
"""
from __future__ import annotations

import os

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

VARIABLE = "MARIN_SITE"
PROVIDER = "marin-site"  # record.config_search_path leaves it out: site values are not the run's


class MarinSiteSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        folder = os.environ.get(VARIABLE)
        if folder:
            search_path.append(provider=PROVIDER, path=f"file://{os.path.abspath(os.path.expanduser(folder))}")
