"""What the files mean: configs, tensor anatomy, inventories, tokenizers, and loading the model."""
