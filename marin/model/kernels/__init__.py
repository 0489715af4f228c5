"""GPU kernels beside the maths they speed up (docs/DESIGN: one switch each, the plain-JAX path
kept as the reference they are tested against): `packed_attention` (`attention.impl=cudnn`),
`grouped_matmul` (`model.grouped_matmul=mosaic`: JAX's Mosaic GPU grouped GEMM for the ragged paths)."""
