package engine

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks, after every test of the package has run, that no goroutine is
// left behind: no script or subscription goroutine, no loop, no AfterFunc.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
