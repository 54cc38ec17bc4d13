"""Test support shipped with the package (GUIDE §2: fakes and harnesses live beside the code they test)."""
