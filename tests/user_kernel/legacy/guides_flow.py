"""The user's script, as the guides write it: a kernel against XLA's legacy custom-call ABI,
loaded with ctypes, registered by capsule with torch_xla's `_xla_register_custom_call_target`,
called with `_xla_custom_call` at api_version 1, 2 or 3 (4: a typed FFI handler), then
`xm.mark_step()` and `.cpu()`. Prints the result ([5.0, 7.0, 9.0]).

    python guides_flow.py LIBRARY API_VERSION PLATFORM [--target NAME] [--symbol NAME]
                          [--with-import] [--check-failure]

--with-import adds the one line a user adds where torch_xla_ext is not installed as a wheel
(a wheel's entry points import it with torch_xla). --check-failure then registers the
library's XlaGpuSimpleAddChecked (api_version 2), calls it on a NaN, expects the kernel's
message as a Python error, and calls it again correctly.
"""

import argparse
import ctypes

parser = argparse.ArgumentParser()
parser.add_argument("library")
parser.add_argument("api_version", type=int)
parser.add_argument("platform")
parser.add_argument("--target", default="XlaGpuSimpleAdd")
parser.add_argument("--symbol", default=None, help="the function's symbol (default: --target)")
parser.add_argument("--with-import", action="store_true")
parser.add_argument("--check-failure", action="store_true")
args = parser.parse_args()

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

if args.with_import:
    import torch_xla_ext  # noqa: F401

lib = ctypes.CDLL(args.library, ctypes.RTLD_GLOBAL)
PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
function = getattr(lib, args.symbol or args.target)
capsule = PyCapsule_New(ctypes.cast(function, ctypes.c_void_p).value,
                        b"xla._CUSTOM_CALL_TARGET", None)
torch_xla._XLAC._xla_register_custom_call_target(args.target, capsule, args.platform)

device = xm.xla_device()
a = torch.tensor([1.0, 2.0, 3.0], device=device)
b = torch.tensor([4.0, 5.0, 6.0], device=device)
out, = torch_xla._XLAC._xla_custom_call([a, b], args.target, [[3]], [torch.float32], False, "",
                                         args.api_version, {})
xm.mark_step()
print(out.cpu())
print(out.cpu().tolist())

if args.check_failure:
    checked = lib.XlaGpuSimpleAddChecked
    torch_xla._XLAC._xla_register_custom_call_target(
        "XlaGpuSimpleAddChecked", PyCapsule_New(ctypes.cast(checked, ctypes.c_void_p).value,
                                                b"xla._CUSTOM_CALL_TARGET", None),
        args.platform)
    nan = torch.tensor([1.0, float("nan"), 3.0], device=device)
    bad, = torch_xla._XLAC._xla_custom_call([nan, b], "XlaGpuSimpleAddChecked", [[3]],
                                             [torch.float32], False, "", 2, {})
    try:
        bad.cpu()
        raise SystemExit("XlaGpuSimpleAddChecked on a NaN did not fail")
    except RuntimeError as e:
        assert "XlaGpuSimpleAddChecked: an input holds a NaN" in str(e), e
        print("failure raised:", str(e).splitlines()[0][:200])
    good, = torch_xla._XLAC._xla_custom_call([a, b], "XlaGpuSimpleAddChecked", [[3]],
                                              [torch.float32], False, "", 2, {})
    print("next call:", good.cpu().tolist())
