"""The training loop: state, the jitted step, evaluation, checkpoints, preemption."""
