"""Inference on a trained model: the one generate loop (and a sample's text), the
generation job, the memorization job."""
