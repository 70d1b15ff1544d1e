# SHIM(issue17): moved to eaas.runtime.client.dispatch.staging; remove at merge
from eaas.runtime.client.dispatch.staging import FrameStaging, device_frames, staging_device  # noqa: F401
