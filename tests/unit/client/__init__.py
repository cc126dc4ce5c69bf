"""Unit tests of the Python client and `meshserve bench`."""
