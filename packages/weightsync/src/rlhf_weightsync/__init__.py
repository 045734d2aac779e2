"""weightsync"""
