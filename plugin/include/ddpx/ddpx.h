#pragma once
// Umbrella header: everything a C++ trainer needs from ddpx.
#include <ddpx/amp.h>
#include <ddpx/comm.h>
#include <ddpx/data.h>
#include <ddpx/grad_sync.h>
#include <ddpx/layer_drop.h>
#include <ddpx/ops.h>
#include <ddpx/codec.h>
