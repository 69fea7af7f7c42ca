"""Torch-free specs: the one home of what each TP strategy and each arch *is*.

Validation, the pipeline's boundary shapes, the cost model, the plots and the runtime all
read these tables instead of comparing names, so a new strategy or arch is its own runtime
module plus one entry here. This package imports nothing else from boostlr (the config
package reads it while it is still being imported).
"""
