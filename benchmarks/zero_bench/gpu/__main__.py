from zero_bench.gpu.driver import main

raise SystemExit(main())
