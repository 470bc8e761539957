"""Sampling: the sampler, its filters and penalties, structured output, watermark and detokenizer."""
