"""Pallas kernels (GPU Triton, TPU Mosaic, CPU interpreter), each beside a pure-JAX reference.

    from meshwork.kernels.flash_attention import flash_attention, flash_attention_reference
    from meshwork.kernels.decode_attention import decode_attention, decode_attention_reference
    from meshwork.kernels.paged_attention import paged_attention, paged_attention_reference

Nothing is re-exported here: a package attribute named like its submodule
(`meshwork.kernels.flash_attention`) would hide the module from
`import meshwork.kernels.flash_attention as fa`.
"""
