"""The scheduling core: the engine loop, scheduler, block manager, sequences and their outputs."""
