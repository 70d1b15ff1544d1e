# SHIM(issue17): moved to eaas.native.device_check; remove at merge
from eaas.native.device_check import main  # noqa: F401

if __name__ == "__main__":  # `python -m eaas.runtime.gpu.device_check` keeps working
    raise SystemExit(main())
