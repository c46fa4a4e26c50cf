from lightning_fl.cli import main

if __name__ == "__main__":
    main()
