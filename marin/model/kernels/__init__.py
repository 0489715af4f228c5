"""GPU kernels beside the maths they speed up (docs/DESIGN: one switch each, the plain-JAX path
kept as the reference they are tested against): `packed_attention` (`attention.impl=cudnn`)."""
