"""``python -m eaas.operator.crd [REPO_ROOT]``: regenerate the committed CRD files."""

from eaas.operator.crd.schema import main

raise SystemExit(main())
