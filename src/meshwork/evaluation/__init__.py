"""How models are scored: next-token cross-entropy (the LM objective and validation loss)
and a classifier that grades generated digits."""
