"""Named configs of the GPU benchmarks (benchmarks/gpu.py, train_step.py): lists of Hydra overrides,
composed as launch.py composes them, so a figure is reproducible from its preset's name."""
from __future__ import annotations

# One H200 (hardware=h200: one local GPU). Synthetic data in the loader's layout, the vocabulary
# of the hero's tokenizer (data=builtin with data.allow_vocab_mismatch: nothing is read).
_ONE_GPU = ["hardware=h200", "data=builtin", "data.allow_vocab_mismatch=true"]
PRESETS = {
    # The d768 rung on one GPU: 1.59B total / 60.6M active, E384 top-8, 32 × 4,096 tokens a step.
    "d768": ["experiment=ladder_d768", *_ONE_GPU, "train.global_batch=32"],
    # Hero-shaped on one GPU: d 2048, 8 layers, E64 top-8, expert width and latent 1024, seq 4,096.
    "d2048": ["experiment=mochi_535b_a23b", *_ONE_GPU, "model.d_model=2048", "model.num_layers=8",
              "model.num_experts=64", "model.expert_width=1024", "model.latent_dim=1024",
              "model.shared_width=1024", "model.ep_transport=fixed", "hardware.racks=1", "hardware.mesh.fsdp=false",
              "train.global_batch=8"],
}
VARIANTS = {
    "d768": {"base": [], "recipe offload": ["optim.offload=true", "model.offload_carry=true"],
             "blockwise attention": ["attention.impl=blockwise"]},
    "d2048": {"base": [], "ragged grouped GEMM": ["model.ep_transport=ragged"]},
}
# --tiny: the same parts on the micro model, CPU-sized.
TINY_PRESETS = {"micro": ["model=micro", "train.seq_len=128", "train.global_batch=4", "attention.window=32"]}
TINY_VARIANTS = {"micro": {"base": [], "reference attention": ["attention.impl=reference"]}}
