import sys

from course.figures import main

sys.exit(main())
