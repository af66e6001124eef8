"""Building blocks shared by the models: params, norm, rope, attention, mlp, embed."""
