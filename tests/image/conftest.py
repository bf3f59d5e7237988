"""tests/image: the built CPU image (deploy/image/build-local.sh), run from its own root file system. Shares the
integration harness and its default_model fixture."""
import importlib.util
import pathlib
import sys

_integration = pathlib.Path(__file__).resolve().parents[1] / "integration"
sys.path.insert(0, str(_integration))
_spec = importlib.util.spec_from_file_location("baton_integration_conftest", _integration / "conftest.py")
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
default_model = _shared.default_model
