"""The test suite. Shared helper modules sit at this level (engine_util, hf_models, ...);
tests live in one folder per capability."""
