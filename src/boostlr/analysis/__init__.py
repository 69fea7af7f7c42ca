"""boostlr.analysis: communication and cost formulas."""
