"""boostlr.data"""
