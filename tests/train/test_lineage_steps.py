"""Issue 40 items 6 and 7 end to end, on one tiny run at seq_len 32 with checkpoints every 3 steps:

- `train.stop_at=4` (a lineage's cutover, not a checkpoint step) ends a fork of it at exactly step
  4 with a checkpoint there, STOPPED 4/8; `resume=` keeps it (nothing to train); `fork=<it>@4`
  then works.
- a context stage at seq_len 64 from that checkpoint (`train.init_from=…@4`, continue mode)
  continues every source at its next whole chunk of 64 tokens (data.shuffle_window 64), not at the
  closed form a fresh run at 64 would use; it scores its eval at 32 tokens (train.eval_seq_len)."""
from __future__ import annotations

import shlex

import pytest

from tests.helpers import compose_dict, new_store, signals_kept
from tests.train.test_mixture_swap_resume import _saved_meta

RUN = ["model=micro", "train.steps=8", "train.seq_len=32", "train.global_batch=4", "train.eval_every=0",
       "train.eval_batches=1", "train.checkpoint.every_steps=3", "data.shuffle_window=64"]


@pytest.mark.slow
def test_stop_at_makes_the_cutover_checkpoint_and_a_stage_keeps_every_read_position(tmp_path, capsys):
    from mlflow import MlflowClient
    from omegaconf import OmegaConf

    from marin.data.loader import Loader
    from marin.launch.checks import load
    from marin.launch.fork import fork
    from marin.launch.resume import resume
    from marin.track import record, runstate
    from marin.train.checkpoint import checkpoint_dir, listed_steps
    from marin.train.loop import train

    where = [f"run.out_dir={tmp_path}", f"tracking.uri={new_store(tmp_path)}"]
    composed, cfg = load(compose_dict(*RUN, "train.stop_after=6", *where))
    parent = record.create(composed, cfg, [*RUN, "train.stop_after=6", *where])
    with signals_kept():
        train(cfg, parent)
        assert listed_steps(checkpoint_dir(parent.run_dir)) == [3, 6]
        spec = f"{parent.run_id}@4"
        with pytest.raises(SystemExit):  # no checkpoint at 4: the one line says how to make it
            fork(OmegaConf.create({"fork": spec}), [f"fork={spec}", *where])
        line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: fork:")][-1]
        make, then = line.split("make one: ", 1)[1].split(", then ")
        args = shlex.split(make)[2:]  # python launch.py fork=…@3 train.stop_at=4 run.name=…
        assert args[1:2] == ["train.stop_at=4"]
        made = fork(OmegaConf.create({"fork": args[0].split("=", 1)[1]}), [*args, *where])
        assert listed_steps(checkpoint_dir(made.run_dir)) == [4]  # exactly at the cutover, not at 3 or 6
        run = MlflowClient(made.tracking_uri).get_run(made.run_id)
        assert runstate.state(run.info.status, run.data.tags) == "STOPPED"
        assert run.data.tags["ended"].startswith("stopped at step 4 of 8 (train.stop_at)")
        capsys.readouterr()
        resume([f"resume={made.run_dir}"])  # stop_at is the run's, not one invocation's: nothing to train
        assert "already at step 4 of 8 (train.stop_at=4, kept by resume=)" in capsys.readouterr().out
        assert listed_steps(checkpoint_dir(made.run_dir)) == [4]
        [then] = shlex.split(then)[2:]  # python launch.py fork=…@4
        child = fork(OmegaConf.create({"fork": then.split("=", 1)[1]}), [then, *where, "train.stop_after=5"])
        assert OmegaConf.load(child.run_dir / "resolved.yaml").fork == f"{made.run_id}@4"
        assert child.run_dir != made.run_dir and listed_steps(checkpoint_dir(child.run_dir)) == [5]

        stage_args = [*RUN, "train.seq_len=64", "train.init_seq_len=32", "train.eval_seq_len=32",
                      f"train.init_from={made.run_dir}@4", "train.init_from_mode=continue", "train.stop_after=6",
                      *where]
        composed, stage_cfg = load(compose_dict(*stage_args))
        stage = record.create(composed, stage_cfg, stage_args)
        train(stage_cfg, stage)

    import json

    rows = [json.loads(x) for x in (stage.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r["key"].startswith("eval/") and r["step"] == 6 for r in rows)  # scored at 32 tokens, trained at 64
    assert {b["inputs"].shape[1] for s in Loader(stage_cfg, progress=False).eval_batches().values() for b in s} == {32}
    at_cut = _saved_meta(made.run_dir, 4)
    assert at_cut["data"]["seq_len"] == 32
    expected = Loader(stage_cfg, progress=False)
    expected.resume(4, at_cut)
    fresh = Loader(stage_cfg, progress=False)
    for name_index, name in enumerate(expected.source_names):
        rows = sum(v for k, v in at_cut["data"]["rows"].items() if k.startswith(f"{name}/"))
        assert int(expected._rows_before(4)[name_index]) == -(-rows * 32 // 64)  # the next whole 64-token chunk
    assert _saved_meta(stage.run_dir, 6)["data"] == expected.position(6)  # what the stage read: from there on
    assert expected.position(6) != fresh.position(6)  # not the closed form at 64 (positions discarded)
