"""`pip install ./client/python` into a fresh virtual environment: the
installed package imports from there with the extension pip built beside
it, finds libdeltad_client.so through DELTAD_CLIENT_LIBRARY or beside
itself, and says everywhere it looked when it finds it nowhere."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROBE = ("import deltad, sys; c = deltad.Client(socket=None, "
         "budget_bytes=1 << 20); print(deltad.__file__); "
         "print(c.stats().budget_bytes); c.close()")


class PipInstallTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.library = os.environ.get("DELTAD_CLIENT_LIBRARY")
        if not cls.library:
            raise unittest.SkipTest("DELTAD_CLIENT_LIBRARY is not set (ctest "
                                    "sets it to the built library)")
        cls.dir = tempfile.TemporaryDirectory(prefix="deltad-venv-")
        venv = os.path.join(cls.dir.name, "venv")
        # Debian's setuptools from the system, so that nothing is downloaded.
        subprocess.run([sys.executable, "-m", "venv",
                        "--system-site-packages", venv], check=True)
        cls.python = os.path.join(venv, "bin", "python")
        # From a copy: setuptools writes build/ and *.egg-info beside the
        # sources, which must not land in the checkout.
        source = os.path.join(cls.dir.name, "source")
        shutil.copytree(os.path.join(REPO, "client", "python"), source,
                        ignore=shutil.ignore_patterns("__pycache__"))
        cls.install = subprocess.run(
            [cls.python, "-m", "pip", "install", "--no-build-isolation",
             "--no-deps", "--no-index", "--quiet", source],
            capture_output=True, text=True, timeout=300)

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def run_probe(self, library=None):
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "DELTAD_CLIENT_LIBRARY")}
        if library:
            env["DELTAD_CLIENT_LIBRARY"] = library
        return subprocess.run([self.python, "-c", PROBE], env=env,
                              cwd=self.dir.name, capture_output=True,
                              text=True, timeout=60)

    def package_dir(self):
        r = subprocess.run([self.python, "-c",
                            "import deltad, os; "
                            "print(os.path.dirname(deltad.__file__))"],
                           env={"PATH": os.environ.get("PATH", "")},
                           cwd=self.dir.name, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout.strip()

    def test_installs(self):
        self.assertEqual(self.install.returncode, 0,
                         self.install.stdout + self.install.stderr)

    def test_the_installed_package_uses_the_library_it_is_pointed_at(self):
        r = self.run_probe(self.library)
        self.assertEqual(r.returncode, 0, r.stderr)
        where, budget = r.stdout.split()
        self.assertTrue(where.startswith(self.dir.name), where)
        self.assertEqual(int(budget), 1 << 20)

    def test_without_the_library_the_error_says_where_it_looked(self):
        r = self.run_probe()
        if r.returncode == 0:
            self.skipTest("a libdeltad_client.so is installed on this "
                          "machine: nothing to miss")
        self.assertIn("cannot load the deltad client library", r.stderr)
        self.assertIn("DELTAD_CLIENT_LIBRARY", r.stderr)
        self.assertIn("cmake --install", r.stderr)
        self.assertIn(os.path.join(self.package_dir(),
                                   "libdeltad_client.so"), r.stderr)

    def test_a_library_beside_the_package_is_found(self):
        beside = os.path.join(self.package_dir(), "libdeltad_client.so")
        shutil.copy(self.library, beside)
        try:
            r = self.run_probe()
            self.assertEqual(r.returncode, 0, r.stderr)
        finally:
            os.remove(beside)

    def test_the_installed_package_has_its_extension_beside_it(self):
        # Built by pip from deltad/_savedcore.c; no client library needed.
        probes = ["import deltad._savedcore as c; print(c.__file__)"]
        try:
            import torch  # noqa: F401
            probes.append("import deltad.torch, deltad.saved as s; "
                          "print(s._core.__file__)")
        except ImportError:
            pass  # deltad.torch needs it
        for probe in probes:
            r = subprocess.run([self.python, "-c", probe],
                               env={"PATH": os.environ.get("PATH", "")},
                               cwd=self.dir.name, capture_output=True,
                               text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(r.stdout.strip().startswith(self.package_dir()),
                            r.stdout)


if __name__ == "__main__":
    unittest.main()
