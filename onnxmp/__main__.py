import sys

from onnxmp.cli import main

sys.exit(main())
