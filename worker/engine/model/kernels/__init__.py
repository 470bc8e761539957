"""The CPU kernels: their C++ sources and headers, and the one build that compiles them."""
