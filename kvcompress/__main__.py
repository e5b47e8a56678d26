from kvcompress.cli import main

main()
