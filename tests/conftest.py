import os
import sys

# `tolerances` and the shared helpers are imported by name from the test files.
sys.path.insert(0, os.path.dirname(__file__))
