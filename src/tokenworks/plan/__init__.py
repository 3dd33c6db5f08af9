"""Prediction: what the arithmetic says an inference setup should do, before running it.

Does a model fit, what is the ceiling, where is the bottleneck, what will it cost. Every
module here imports nothing of tokenworks but `units` and the torch-free `shapes`: the
toolkit stands on its own, with no weights and no torch.
"""
