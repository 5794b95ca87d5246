"""Test-wide JAX settings.

x64 is on so the oracle can run in float64; every input under test carries an
explicit dtype, so float32 and bfloat16 paths still run as they would in a model.
"""

import jax

jax.config.update("jax_enable_x64", True)
