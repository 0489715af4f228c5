"""On the local Slurm cluster (scripts/services_up.sh): the launch path with a cheap probe in each
task, a multirun as one job array (a job of it then reproduced on Slurm bit for bit and forked, by
the name `marin.status` prints for it), a 2-process training job that logs one MLflow run and takes a
forced checkpoint, and a job whose task hangs (caught by the hang watchdog), then, restarted, is
killed (kill -9), and then, restarted again, is preempted: each fault restarts it, the preemption
requeues it, and it finishes with exactly the losses of the uninterrupted job."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marin.train.preempt import WATCHDOG_EXIT
from tests.helpers import checkpoint_sealed, launch_here, make_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PROBE = {"MARIN_SLURM_ENTRY": "tests.launch.slurm_entries:probe"}
LATE = {"MARIN_SLURM_ENTRY": "tests.launch.slurm_entries:late_start"}
PROBE_TRAIN = {"MARIN_SLURM_ENTRY": "tests.launch.slurm_entries:probe_and_train"}
# 2 processes × 1 CPU, experts split over them; tiny shapes so compilation dominates (cached).
STEPS = 32
TRAIN = ["hardware=slurm_cpu", "model=micro", f"train.steps={STEPS}", "train.seq_len=32", "train.global_batch=4",
         "train.eval_every=0", "train.eval_batches=1", "train.checkpoint.every_steps=8"]


def env_with(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MARIN_SLURM_ENTRY"}
    env.update(extra or {})
    return env


def launch(*args: str, extra_env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env_with(extra_env))


def field(text: str, name: str) -> str:
    match = re.search(rf"^{name}: (\S+)", text, re.M)
    assert match, f"no '{name}:' line in:\n{text}"
    return match.group(1)


def sacct_state(job_id: str) -> str:
    done = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True)
    lines = done.stdout.split()
    return lines[-1] if lines else "UNKNOWN"


def wait_for_job(job_id: str, timeout: float = 800) -> str:
    end = time.time() + timeout
    while time.time() < end:
        state = sacct_state(job_id)
        if state.split()[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"):
            return state
        time.sleep(2)
    subprocess.run(["scancel", job_id])
    pytest.fail(f"job {job_id} still {sacct_state(job_id)} after {timeout} s")


def losses(uri: str, run_id: str) -> dict[int, float]:
    from mlflow import MlflowClient

    return {m.step: m.value for m in MlflowClient(uri).get_metric_history(run_id, "train/loss")}


def test_probe_job_sees_two_processes_split_experts_and_no_outer_slurm_variables(tmp_path, tracking_uri):
    outer = {**PROBE, "SLURM_JOB_ID": "999999", "SLURM_NTASKS": "5", "SLURM_OUTER_MARKER": "leaked",
             "CUDA_VISIBLE_DEVICES": "7"}
    done = launch("hardware=slurm_cpu", "model=micro", "wait=true", f"run.out_dir={tmp_path}",
                  f"tracking.uri={tracking_uri}", extra_env=outer)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = Path(field(done.stdout, "run directory"))
    assert field(done.stdout, "slurm job").isdigit() and field(done.stdout, "mlflow run")
    seen = [json.loads((run_dir / f"probe-{i}.json").read_text()) for i in (0, 1)]
    for i, s in enumerate(seen):
        assert (s["process_index"], s["process_count"], s["device_count"]) == (i, 2, 2)
        assert s["mesh"] == {"replica_dcn": 1, "data": 1, "expert": 2, "model": 1}
        assert s["experts_here"] * 2 == s["experts"]          # each process holds half of the experts
        assert s["gathered"] == [0, 1]                         # a cross-process collective worked
        assert s["env"]["SLURM_NTASKS"] == "2" and s["env"]["SLURM_JOB_ID"] != "999999"
        assert "SLURM_OUTER_MARKER" not in s["env"] and "CUDA_VISIBLE_DEVICES" not in s["env"]
        assert s["env"]["JAX_PLATFORMS"] == "cpu"              # the hardware's environment


def test_wait_exits_with_the_jobs_failure(tmp_path, tracking_uri):
    done = launch("hardware=slurm_cpu", "hardware.tasks_per_node=1", "hardware.mesh.expert=1", "model=micro",
                  "wait=true", "hardware.max_restarts=0",
                  f"run.out_dir={tmp_path}", f"tracking.uri={tracking_uri}",
                  extra_env={"MARIN_SLURM_ENTRY": "tests.launch.slurm_entries:crash"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "deliberate failure" in done.stderr and "failed" in done.stderr


def test_a_refused_submission_is_reported_and_resumable(tmp_path, tracking_uri):
    done = launch("hardware=slurm_cpu", "model=micro", "hardware.partition=no_such_partition",
                  f"run.out_dir={tmp_path}", f"tracking.uri={tracking_uri}", extra_env=PROBE)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "sbatch failed" in done.stderr and "resume=" in done.stderr and "Traceback" not in done.stderr


# A sweep of two tiny trainings, checkpointed at step 2: each job is then reproduced and forked by
# the name `marin.status` prints for it.
GRID_STEPS = 4
GRID = ["hardware=slurm_cpu", "hardware.tasks_per_node=1", "hardware.mesh.expert=1", "model=micro",
        f"train.steps={GRID_STEPS}", "train.seq_len=32", "train.global_batch=4", "train.eval_every=0",
        "train.eval_batches=1", "train.checkpoint.every_steps=2", "run.sweep=slurmgrid"]


def test_multirun_is_one_job_array_and_returns_at_once(tmp_path, tracking_uri, capsys):
    """Then (issue 42: sweep jobs are runs) a job of the array, by the name `marin.status` prints
    for it (`slurmgrid/lr=0.001`), is reproduced on Slurm (submitted again) bit for bit, and a fork
    of it by that name is accepted."""
    from marin.data.prepare import prepare

    where = [f"run.out_dir={tmp_path}", f"tracking.uri={tracking_uri}"]
    prepare(make_config(*GRID, f"run.out_dir={tmp_path}"), progress=False)  # once, not by each job
    # one task an element (the probe above checks a job's two): what is under test is the array
    done = launch("-m", "hydra/launcher=marin_slurm", *GRID, "optim.lr=0.001,0.003", *where, extra_env=PROBE_TRAIN)
    assert done.returncode == 0, done.stdout + done.stderr
    array = re.search(r"slurm array (\d+): 2 jobs", done.stdout)
    assert array, done.stdout
    jobs = re.findall(r"job (\d+_\d+)\s+run (\w+)\s+(\S+)", done.stdout)
    assert [j[0] for j in jobs] == [f"{array.group(1)}_0", f"{array.group(1)}_1"]
    for job_id, _, run_dir in jobs:
        assert wait_for_job(job_id).startswith("COMPLETED")
        assert json.loads((Path(run_dir) / "probe-0.json").read_text())["process_count"] == 1
    from mlflow import MlflowClient
    from omegaconf import OmegaConf

    assert sorted(OmegaConf.load(Path(d) / "resolved.yaml").optim.lr for _, _, d in jobs) == [0.001, 0.003]
    # one MLflow parent for the sweep, a child per array element, tagged with what differs
    client = MlflowClient(tracking_uri)
    children = [client.get_run(run_id).data.tags for _, run_id, _ in jobs]
    parents = {tags["mlflow.parentRunId"] for tags in children}
    assert len(parents) == 1 and None not in parents
    assert sorted(json.loads(tags["sweep_overrides"]) for tags in children) == [["optim.lr=0.001"], ["optim.lr=0.003"]]

    # the job's name as `python -m marin.status <sweep>` prints it
    from marin import status

    capsys.readouterr()
    assert status.main(["slurmgrid", "--out-dir", str(tmp_path), "--tracking-uri", tracking_uri]) == 0
    table = capsys.readouterr().out
    names = {line.split()[0]: line.split()[-1] for line in table.splitlines()[2:] if line.strip()}
    assert set(names) == {"lr=0.001", "lr=0.003"}, table
    original = Path(next(d for _, run_id, d in jobs if run_id == names["lr=0.001"]))
    ref = "slurmgrid/lr=0.001"
    # reproduced as it ran: submitted to Slurm again (its saved hardware), followed to its end
    again = launch(f"reproduce={ref}", "wait=true", *where)
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert field(again.stdout, "slurm job").isdigit()
    copy = Path(field(again.stdout, "run directory"))
    assert copy != original and copy.name.startswith("slurmgrid-lr=0.001-reproduce-"), copy
    assert "changed since the run" not in again.stderr, again.stderr[-3000:]
    reference = dict(logged_losses(original))
    other = dict(logged_losses(Path(next(d for _, run_id, d in jobs if run_id == names["lr=0.003"]))))
    assert sorted(reference) == list(range(1, GRID_STEPS + 1)) and other != reference   # the name picks its job
    assert dict(logged_losses(copy)) == reference                            # bit for bit
    # forked by that name from its checkpoint at step 2 (a dry run: the fork's plan, nothing submitted)
    assert launch_here(f"fork={ref}@2", "dry_run=true", *where) == 0
    said = capsys.readouterr().out
    assert f"forking run {names['lr=0.001']} ({original}) at step 2" in said, said


def run_dir_of(runs_dir: Path, name: str) -> Path | None:
    """The directory of the run `name` under `runs_dir`, once launch.py has made it."""
    return next(iter(sorted(runs_dir.glob(f"{name}-*"))), None)


def submitted(runs_dir: Path, name: str) -> tuple[str, Path] | None:
    """(Slurm job id, run directory) of the run `name` under `runs_dir` once it is submitted."""
    if run_dir := run_dir_of(runs_dir, name):
        for script in (run_dir / "slurm").glob("*_submission.sh"):
            return script.name.split("_")[0], run_dir
    return None


_ASKED: dict[str, float] = {}  # job id: when sacct was last asked whether it still runs


def still_running(job_id: str, waiting_for: str) -> None:
    """Fails once the job has ended (what it was waiting for never came); asks sacct at most every
    2 s (the tests poll what they wait for five times a second)."""
    if time.monotonic() - _ASKED.get(job_id, 0.0) < 2.0:
        return
    _ASKED[job_id] = time.monotonic()
    state = sacct_state(job_id)
    assert state.split()[0] in ("PENDING", "RUNNING", "REQUEUED", "UNKNOWN"), f"{waiting_for} ({state})"


def faults_of(run_dir: Path) -> list[dict]:
    """The faults the restart policy recorded for a run (restarts.jsonl), oldest first."""
    path = run_dir / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def checkpointed(runs_dir: Path, name: str, faults: int, past: int) -> str | None:
    """The Slurm job id of the run `name` once `faults` (≥ 1) faults have restarted it and it has
    sealed the checkpoint `past` steps after the step it last resumed from (so the attempt that
    wrote it is training, its signal handlers installed); fails once the job is no longer running
    without it."""
    if not (job := submitted(runs_dir, name)):
        return None
    job_id, run_dir = job
    seen = faults_of(run_dir)
    if len(seen) >= faults and checkpoint_sealed(run_dir, seen[faults - 1]["resume_step"] + past):
        return job_id
    still_running(job_id, f"no checkpoint {past} steps on in {name} after {faults} faults")
    return None


def kill_task(job_id: str, task: int) -> int:
    """kill -9 the Python process of one task of the job's first step; returns its pid."""
    pids = subprocess.run(["scontrol", "listpids", job_id], capture_output=True, text=True, check=True).stdout
    for line in pids.splitlines()[1:]:
        pid, _, step, _, global_id = (line.split() + [""] * 5)[:5]
        cmdline = Path(f"/proc/{pid}/cmdline")
        if step == "0" and global_id == str(task) and cmdline.exists() and b"submitit" in cmdline.read_bytes():
            os.kill(int(pid), signal.SIGKILL)
            return int(pid)
    pytest.fail(f"no task {task} in job {job_id}:\n{pids}")


def announced(proc: subprocess.Popen, runs_dir: Path, name: str, tasks: int) -> Path | None:
    """The directory of the run `name` under `runs_dir` (submitted by `proc`) once every task has
    announced itself (its signal handlers are installed), else None."""
    assert proc.poll() is None, f"{name}: launch.py ended before its tasks started"
    run_dir = run_dir_of(runs_dir, name)
    return run_dir if run_dir and len(list((run_dir / "processes").glob("*.json"))) >= tasks else None


def force_checkpoint(run_dir: Path) -> subprocess.Popen:
    """`marin.ctl checkpoint <run>`, not waited for (the other jobs are watched meanwhile)."""
    return subprocess.Popen([sys.executable, "-m", "marin.ctl", "checkpoint", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def preempt(job_id: str) -> None:
    """What Slurm does to a preempted job (and submitit's job._interrupt()): TERM, then USR2."""
    for sig in ("TERM", "USR2"):
        subprocess.run(["scancel", "--signal", sig, job_id], check=True)


def when_ready(actions: dict, timeout: float = 600) -> dict:
    """{name: (ready, act)}: call each `act(what ready() gave)` as soon as `ready()` gives it
    (polled together: the jobs run at once, and one past its first checkpoint finishes in
    seconds); their results."""
    results, end = {}, time.monotonic() + timeout
    while len(results) < len(actions):
        for name, (ready, act) in actions.items():
            if name not in results and (got := ready()):
                results[name] = act(got)
        assert time.monotonic() < end, f"never ready: {sorted(set(actions) - set(results))}"
        time.sleep(0.2)
    return results


# The faulty job's watchdog limit: CI's 2 loaded cores have run these steps at 2.3 s each, and a 6 s
# limit once fired on a step that was only slow. It checkpoints every 4 steps: the hang before step 7
# resumes from 4; the kill comes once the restarted job has sealed step 8 (24 steps before the end),
# and the preemption once the job restarted after the kill has sealed step 12 (20 before the end).
HANG_LIMIT_S, HANG_STEP, FAULTY_EVERY, KILL_AFTER = 20.0, 7, 4, 8


JOBS = {  # run.name: its own overrides
    # Room for its two faults and one more: the tests then count exactly two, so a preemption that
    # failed to requeue (a third fault, restarted by the policy) cannot hide.
    "faulty": ["hardware.max_restarts=3",
               f"train.checkpoint.every_steps={FAULTY_EVERY}", f"train.watchdog_minutes={HANG_LIMIT_S / 60}",
               f"debug.hang_at_step={HANG_STEP}", "debug.hang_process=1"],
    "straight": ["wait=true"],
}



@pytest.fixture(scope="module")
def runs(tmp_path_factory, tracking_uri):
    """The same training twice on the cluster at once:
    - straight through (`wait=true`, from the command line), its task 1 starting 40 s late (task 0
      waits for it past gloo's 30 s rendezvous), with a forced checkpoint (`marin.ctl checkpoint`
      → scancel --signal=USR1) at its first step boundary, after which it trains on;
    - faulty: its task 1 hung before step 7 (task 0 then waits in the step's collectives): both
      tasks' hang watchdogs fire and the job restarts from its checkpoint at step 4; then, once the
      restarted job has sealed step 8, its task 1 killed (SIGKILL): it restarts from step 8; then,
      once that attempt has sealed step 12, preempted: it checkpoints and requeues itself.
    One job takes the three: a job for each cost two more tasks' start and compile and a tracking
    process each (about 25 CPU-s)."""
    from marin.data.prepare import prepare

    out = tmp_path_factory.mktemp("slurm-train")
    common = [*TRAIN, f"run.out_dir={out}", f"tracking.uri={tracking_uri}"]
    # Tokenized here, once, not by each job.
    prepare(make_config(*TRAIN, f"run.out_dir={out}"), progress=False)
    # Both submitted at once: a job past its first checkpoint ends in seconds, so what is done to
    # one must not wait for the other's submission.
    procs = {name: subprocess.Popen([sys.executable, "launch.py", *common, f"run.name={name}", *extra], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env_with(LATE if name == "straight" else None))
             for name, extra in JOBS.items()}
    runs_dir = out / "runs"
    try:
        ctl = when_ready({
            "kill": (lambda: checkpointed(runs_dir, "faulty", faults=1, past=KILL_AFTER - FAULTY_EVERY),
                     lambda job_id: kill_task(job_id, 1)),
            "preempt": (lambda: checkpointed(runs_dir, "faulty", faults=2, past=FAULTY_EVERY), preempt),
            "straight": (lambda: announced(procs["straight"], runs_dir, "straight", tasks=2), force_checkpoint),
        })["straight"]
        said = {name: proc.communicate(timeout=800) for name, proc in procs.items()}
        asked, ctl_err = ctl.communicate(timeout=120)
        assert ctl.returncode == 0, ctl_err
    except BaseException:  # a fixture that failed leaves nothing running on the shared cluster
        for name in JOBS:
            if job := submitted(runs_dir, name):
                subprocess.run(["scancel", job[0]], check=False)
        raise
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    (stdout, stderr), code = said["faulty"], procs["faulty"].returncode
    assert code == 0, stdout + stderr
    job_id = field(stdout, "slurm job")
    faulty = (job_id, Path(field(stdout, "run directory")), stdout, wait_for_job(job_id))
    (stdout, stderr), straight = said["straight"], procs["straight"]
    return {"straight": (straight.returncode, stdout, stderr), "asked": asked, "uri": tracking_uri,
            "faulty": faulty}


def test_two_process_job_trains_and_logs_one_mlflow_run(runs):
    from mlflow import MlflowClient

    code, stdout, stderr = runs["straight"]
    assert code == 0, stdout + stderr[-3000:]
    run_dir, run_id = Path(field(stdout, "run directory")), field(stdout, "mlflow run")
    client = MlflowClient(runs["uri"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags.get("jax.process_count") == "2"
    same_dir = client.search_runs([run.info.experiment_id], f"tags.run_dir = '{run_dir}'")
    assert [r.info.run_id for r in same_dir] == [run_id]   # one MLflow run for both processes
    assert sorted(losses(runs["uri"], run_id)) == list(range(1, STEPS + 1))  # step n = n updates taken
    final = run_dir / "checkpoints" / str(STEPS) / "state"
    assert (final / "ocdbt.process_0").is_dir() and (final / "ocdbt.process_1").is_dir()  # both wrote


def test_a_preempted_job_requeues_itself_and_finishes_with_the_same_losses(runs):
    """The faulty job's third interruption, after its two faults: TERM then USR2, as Slurm sends
    them. It checkpoints at the next step boundary and requeues itself, outside the restart
    policy's budget (no third fault), and the requeued job resumes from that checkpoint."""
    job_id, run_dir, stdout, final = runs["faulty"]
    assert final.startswith("COMPLETED"), final
    logs = "".join(p.read_text() for p in (run_dir / "slurm").glob("*_0_log.err"))
    stopped = re.search(r"preemption signal: checkpointed at step (\d+); requeueing", logs)
    assert stopped, logs[-3000:]
    # its first requeue: the faults' restarts have their own budget (hardware.max_restarts)
    assert f"requeued Slurm job {job_id} (restart 1 of at most" in logs, logs[-3000:]
    step = int(stopped.group(1))
    assert KILL_AFTER + FAULTY_EVERY <= step < STEPS
    assert f"resumed from step {step} " in logs.split(stopped.group(0))[1]
    assert [f["exit_code"] == WATCHDOG_EXIT for f in faults_of(run_dir)] == [True, False]  # the hang, the kill
    code, straight_stdout, _ = runs["straight"]
    assert code == 0
    reference = losses(runs["uri"], field(straight_stdout, "mlflow run"))
    resumed = losses(runs["uri"], field(stdout, "mlflow run"))
    assert sorted(resumed) == sorted(reference) == list(range(1, STEPS + 1))
    assert resumed == reference        # bitwise: same floats at every step


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every train/loss row of metrics.jsonl (the run's own record), in the order logged."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["value"]) for r in rows if r["key"] == "train/loss"]


def test_killed_task_restarts_the_job_which_finishes_with_the_same_losses(runs):
    from mlflow import MlflowClient

    job_id, run_dir, stdout, final = runs["faulty"]
    assert final.startswith("COMPLETED"), final        # no person requeued it
    faults = faults_of(run_dir)
    [fault] = [f for f in faults if "SIGKILL" in f["cause"]]   # its second fault (the first: the hang, below)
    assert fault["restarted"] and 0 < fault["resume_step"] <= fault["step"] < STEPS
    code, straight_stdout, _ = runs["straight"]
    assert code == 0
    reference = dict(logged_losses(Path(field(straight_stdout, "run directory"))))
    killed = logged_losses(run_dir)
    assert sorted({step for step, _ in killed}) == list(range(1, STEPS + 1))
    # the steps after each fault's checkpoint ran twice, and the restart dropped the first rows of
    # them (tracker.forget_after): each step once, the replayed ones bitwise the uninterrupted losses
    assert len(killed) == STEPS
    assert all(value == reference[step] for step, value in killed)
    run = MlflowClient(runs["uri"]).get_run(field(stdout, "mlflow run"))
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == str(len(faults))
    assert run.data.metrics["restart/count"] == len(faults) and run.data.metrics["restart/minutes_lost"] >= 0


def test_a_hang_is_caught_the_job_restarts_and_its_losses_equal_the_straight_runs(runs):
    from mlflow import MlflowClient

    job_id, run_dir, stdout, final = runs["faulty"]
    assert final.startswith("COMPLETED"), final
    faults = faults_of(run_dir)
    fault, kill = faults   # the injected hang, then the kill (the preemption after them is no fault)
    assert fault["exit_code"] == WATCHDOG_EXIT and fault["resume_step"] == FAULTY_EVERY, faults  # below step 7
    assert "SIGKILL" in kill["cause"] and kill["resume_step"] == KILL_AFTER, faults
    assert fault["cause"].startswith("the hang watchdog ended a task"), faults
    logs = {task: "".join(p.read_text() for p in (run_dir / "slurm").glob(f"*_{task}_log.err")) for task in (0, 1)}
    for task, text in logs.items():  # every process wrote its stacks, within the limit plus a minute
        fired = re.search(rf"watchdog: process {task}: no step completed for ([\d.]+) s "
                          rf"\(allowed {HANG_LIMIT_S} s\)", text)
        assert fired, text[-3000:]
        assert HANG_LIMIT_S <= float(fired.group(1)) < HANG_LIMIT_S + 60  # printed to 0.1 s
    assert "in hang_if_asked" in logs[1].split("watchdog: process 1")[1]
    client = MlflowClient(runs["uri"])
    assert client.get_run(field(stdout, "mlflow run")).info.status == "FINISHED"
    code, straight_stdout, _ = runs["straight"]
    assert code == 0
    straight = losses(runs["uri"], field(straight_stdout, "mlflow run"))
    hung = [(m.step, m.value) for m in client.get_metric_history(field(stdout, "mlflow run"), "train/loss")]
    assert {step for step, _ in hung} == set(straight) == set(range(1, STEPS + 1))
    assert all(value == straight[step] for step, value in hung)  # replayed steps too: bit for bit


def test_a_forced_checkpoint_is_taken_at_the_first_step_boundary_and_the_job_trains_on(runs):
    from mlflow import MlflowClient

    code, stdout, stderr = runs["straight"]
    assert code == 0 and "(scancel --signal=USR1)" in runs["asked"], f"{runs['asked']}{stdout}{stderr[-3000:]}"
    run_dir = Path(field(stdout, "run directory"))
    task0 = "".join(p.read_text() for p in (run_dir / "slurm").glob("*_0_log.err"))
    assert re.search(r"forced checkpoint at step 1 written and verified", task0), task0[-3000:]
    assert (run_dir / "checkpoints" / "1").is_dir()
    assert MlflowClient(runs["uri"]).get_run(field(stdout, "mlflow run")).data.tags["checkpoint.forced"] == "1"
