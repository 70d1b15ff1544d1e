# SHIM(issue17): moved to eaas.runtime.client.model_runner; remove at merge
from eaas.runtime.client.model_runner import Chunk, PagedModelRunner  # noqa: F401
