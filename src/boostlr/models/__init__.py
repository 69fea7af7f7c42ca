"""boostlr.models"""
