"""Native kernels the worker builds for the machine it runs on."""
