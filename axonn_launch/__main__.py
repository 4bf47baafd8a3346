from axonn_launch.cli import main

if __name__ == "__main__":
    main()
