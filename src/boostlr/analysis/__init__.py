"""boostlr.analysis"""
