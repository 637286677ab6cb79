"""The runner turns scheduler decisions into tensors, runs the model and samples."""
