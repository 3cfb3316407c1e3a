import sys

from course.site.build import main

sys.exit(main())
