"""boostlr.train"""
