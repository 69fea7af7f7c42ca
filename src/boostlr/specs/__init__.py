"""Torch-free specs: the one home of what each TP strategy, arch and pipeline schedule *is*.

Validation, the pipeline's boundary shapes, the cost model, the plots and the runtime all
read these tables instead of comparing names, so a new strategy or arch is its own runtime
module plus one entry here, and a schedule torch has is one entry. This package imports
nothing else from boostlr (the config package reads it while it is still being imported).
"""
