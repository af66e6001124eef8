"""Diffusion math and sampling: the noise schedule and loss, DDPM/DDIM samplers (with
patch-parallel sampling over a mesh), and the image grid."""
