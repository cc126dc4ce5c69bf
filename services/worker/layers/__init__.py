"""Pure-torch reference layers: the CPU implementation and the oracle for device platforms."""
