"""boostlr.parallel"""
