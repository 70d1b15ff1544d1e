"""Ground-floor helpers every layer may use: the dtype names (:mod:`.dtypes`), a free TCP port
(:mod:`.ports`) and the parent-death signal for child processes (:mod:`.process`).
Torch-free at import (the operator imports this package)."""
