"""Serving: scheduler, block manager, sequences, the batch contract, engine options and
admission, sampling, the model runner, the engine and tokenizers."""
