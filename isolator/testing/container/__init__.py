"""What runs inside a test container, stdlib only.

    init.py    the container's init, as the Mesos launcher would run it
    check.py   reports what the container sees, as JSON on stdout

Both are copied into the test rootfs and run by its interpreter, so they import nothing of ours.
"""
