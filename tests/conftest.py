"""Test-session settings: the persistent compilation cache stays off (tests never write to the user's cache
directory; a test that needs the cache points DFLASH_JAX_CACHE_DIR at a temp dir itself)."""

import os

os.environ["DFLASH_JAX_CACHE_DIR"] = "off"
