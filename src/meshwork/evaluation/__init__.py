"""How models are measured: the language models' validation loss and a classifier that grades
generated digits. The training objectives themselves live in meshwork.objectives."""
