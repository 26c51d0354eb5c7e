"""Drop-in versions of other mixed-precision libraries' APIs (jmp, MPX, jaxamp), built on autocast."""
