"""Plan execution: resolve a plan on a module, wrap its layers, recompute and swap activations, account device bytes."""
